"""What a run records: metrics, loggers, MFU, the start-up line, rank-0 logging."""
