"""The PDDeployment resource: its typed values (pddeployment.py) and their one parser (parse.py),
the readers and section parsers it is made of (pod templates, storage, multi-node shape), the
fields pdserve owns, and the vLLM compatibility rules its prefill and decode must meet.
"""
