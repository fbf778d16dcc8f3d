"""The node's own facts: its cards, their memory, the installed engines,
leftovers, processes."""
