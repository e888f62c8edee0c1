"""Model implementations (one module per family) and the architecture registry."""
