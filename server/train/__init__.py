"""Training jobs: a layertap agent inside the user's training process (``layertap.attach``)."""
