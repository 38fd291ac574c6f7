"""What every wing stands on: exit codes, where this process stands, argument types."""
