"""asyncio networking: connections, bootstrap, SASL, source URIs."""
