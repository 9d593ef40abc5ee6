"""``elasticctl``: look at and steer a running elasticrun job (docs/operating.md).

``elasticctl status`` / ``top`` print the driver's status; ``drain HOST``, ``stop``
and ``resize --max-np N`` steer it. Every request is a sealed value in the job's
control store, so only a holder of the job secret is answered or obeyed.
"""
