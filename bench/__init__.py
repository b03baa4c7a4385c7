"""Side-by-side benchmark of a direct connection, nginx and tether in front of a fake engine."""
