"""What a shard records: the recorder interface and the null recorder (recorder.py), and
the Prometheus series behind it (prometheus.py)."""
