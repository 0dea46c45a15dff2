"""Worker: loads one model version, attaches to the scheduler, runs batches and steps."""
