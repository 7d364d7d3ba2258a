"""The workspace registry and each workspace's services and lifecycle."""
