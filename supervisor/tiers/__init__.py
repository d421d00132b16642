"""Tiered checkpoint storage: the local run directory plus one durable remote tier.

    backends.py   a remote named by a URL: a shared directory (os calls, rename commits) or any
                  fsspec filesystem (s3://bucket/prefix through s3fs); imported lazily
    plan.py       pure decisions: the remote commit marker, what to upload next, lag
    remote.py     the protocol over a backend: check, upload (manifest last), download, quarantine, prune
    uploader.py   the trainer side: one upload in flight, busy policy, retries, remote.json
    events.py     the uploader's event log (the watchdog's format, a file of its own)
    resume.py     the watchdog side: newest valid checkpoint across both tiers
    listing.py    both tiers side by side for ``status`` and ``ckpt list``

Nothing here imports torch; fsspec and s3fs are imported only when a non-directory URL is opened.
"""
