"""Reports over run directories (``fedpart report``, ``fedpart compare``): runs.py reads run
directories into plain records (and groups runs that differ only in their seeds), link.py models
time on a network link, tables.py builds the comparison table (a row per run and per group) and
the per-round table, figures.py draws the figures (matplotlib, the ``report`` extra), page.py
renders the self-contained HTML page, and build.py writes them all into one folder."""
