from revffn import console

raise SystemExit(console())
