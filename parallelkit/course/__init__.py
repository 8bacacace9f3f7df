"""The course: lesson helpers, the tour of every strategy, the benchmark command, and the static course build."""
