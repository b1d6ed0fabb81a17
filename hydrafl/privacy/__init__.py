"""Differential privacy with the privacy actually spent: the accountant (`accountant`, over Google's
dp-accounting), clipping and Gaussian noise shared by the coordinator and the sites (`clipping`), adaptive
clipping (`adaptive`), central DP on the strategies' aggregates (`central`) and the run's ledger the round
driver reports from (`ledger`)."""
