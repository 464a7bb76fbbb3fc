"""A cluster's life on its provider (EC2 instances, or the user's own hosts) and Spark on it."""
