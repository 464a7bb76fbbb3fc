"""The SparkNet algorithm: rounds of tau local steps on every worker, then an outer step."""
