"""The PDDeployment resource: its typed values and their one parser, the readers and section
parsers it is made of (pod templates, storage, multi-node shape), the fields pdserve owns, and
the vLLM compatibility rules its prefill and decode must meet.
"""
