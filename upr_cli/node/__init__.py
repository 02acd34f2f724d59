"""The UPR node (`upr serve`): storage, partitions, write queue, KV front end, DCP producer."""
