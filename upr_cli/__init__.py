"""upr: a toolkit for Couchbase's replication protocol (UPR/DCP)."""

__version__ = "0.1.0"
