"""The pytest face: the plugin's wiring (`plugin`), the JSON report, what was selected, the rootdir and the shards."""
