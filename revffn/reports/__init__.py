"""Reports: per-run report (run_report.py), bench runner and rendering."""
