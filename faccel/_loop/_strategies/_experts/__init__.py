"""Expert parallelism: a mixture-of-experts layer's experts split over the ``expert`` ranks of a layout.

``_plan`` is the pure dispatch plan (which rows go to which rank, and back in
their own places); ``_find`` the contract a model's experts meet and the
search for them; ``_dispatch`` the forward that sends each token to its
experts' ranks by all-to-all and combines what comes back; ``_balance`` the
load-balancing options (auxiliary loss, loss-free bias) and the per-step
counts. docs/parallelism.md, "Mixture of experts", is the user's page.
"""
