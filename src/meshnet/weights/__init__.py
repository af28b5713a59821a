"""Weights that travel over the mesh: models known by content, parts served and fetched
(ADR-0054). Imports no torch: the tracker and lean nodes use it."""
