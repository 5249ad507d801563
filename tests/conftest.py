# pytester runs pytest inside a test: the known-issue and report tests use it to show
# the outcomes a whole run produces ("known", "fixed — remove this entry", the JSON).
pytest_plugins = ["pytester"]
