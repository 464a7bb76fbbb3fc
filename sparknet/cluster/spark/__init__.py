"""Spark on a cluster's nodes, set up by the bootstrap.

What each node runs (plan), the install steps (checked, then applied), the daemons, their
settings, the cluster's health, and the bootstrap over all of it."""
