"""Library functions behind every command (the CLI and the Spark jobs call these)."""
