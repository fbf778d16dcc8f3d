"""Who may do what: identities, permissions, passwords."""
