from revffn.cli import main

raise SystemExit(main())
