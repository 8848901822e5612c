"""MTP speculative decoding: the drafter over the MTP head and the draft/verify/accept loop."""
