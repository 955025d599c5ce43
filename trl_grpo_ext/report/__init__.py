"""The console line and the tracker alerts. The report, `report.png` and the model card are in `tools/`."""
