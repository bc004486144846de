"""Calibration passes: statistics of the teacher's routing and experts, streamed or resident, and DCDM mixing."""
