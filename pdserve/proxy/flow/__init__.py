"""One generation request through the router: the dispatcher walks the policy's candidates, an
attempt runs a prefill leg and a decode leg, the relay streams the decode's answer; admission
(back-pressure), the retry rules and the requests that make several sequences.
"""
