"""The metadata store seam and its implementations."""
