"""The router's client to the engines: its HTTP/1.1 connections for the legs, the aiohttp session
for everything else, and JSON on the hot path.
"""
