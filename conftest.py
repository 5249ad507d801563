# The harness's pytest plugin is registered through the pytest11 entry point of the
# installed package; nothing else belongs here.
