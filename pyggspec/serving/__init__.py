"""Serving: requests, the scheduler (the one generation loop) and the HTTP front end."""
