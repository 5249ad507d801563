"""The `harness` command and its subcommands: demo, repro, diff, matrix, merge,
durations and bench."""
