"""Stream: fan each pass's summaries out to subscribers and sinks without ever blocking the model."""
