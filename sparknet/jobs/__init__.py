"""A training job on a cluster, from both ends.

The submit flow on the laptop (its preflight, the driver it starts on the master), following
its progress and attaching again, the records of the jobs started, and the supervisor on the
master."""
