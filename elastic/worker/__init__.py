"""The worker side: rounds, heartbeats, sliced waits, process groups, collectives, the run loop."""
