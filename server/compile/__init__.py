"""Compilation: compiled serving of the whole model (variants by tap set, built in a child process or a
thread), and the reducers' compiled statistics kernel, each compiled off the pass."""
