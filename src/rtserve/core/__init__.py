"""The dataplane: the one place both frontends call."""
