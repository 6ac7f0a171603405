"""A character-level transformer language model on the Python standard library's source: an SGDJob
task (`training.task: "charlm.task:build"`), written as a user's own package would be."""
