"""Planning MANY configurations: memory and speed models, the search, verification and plan writing."""
