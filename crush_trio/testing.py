"""pytest plugin of crush_trio (fixtures for trio integration tests); filled in by the client work."""
