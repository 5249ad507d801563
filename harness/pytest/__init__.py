"""The pytest face: the plugin's wiring (`plugin`), its option table (`settings`), the JSON report, what was selected, the rootdir and the shards."""
