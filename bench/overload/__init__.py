"""The mesh past its capacity: peak goodput, goodput past the peak, flood isolation, generate fairness,
lone latency, and what an idle gap costs the next request."""
