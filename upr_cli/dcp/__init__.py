"""DCP consumer: stream positions, the rollback protocol, flow control, noop, reconnect."""
