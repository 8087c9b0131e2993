"""Flight recorder: triggers on durable taps' summaries, retained inputs, replayed incidents on disk."""
