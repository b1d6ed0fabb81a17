"""quickapp: a quickstart-style Flower app."""
