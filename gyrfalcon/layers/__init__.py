"""nn.Modules that models are built from; they call gyrfalcon.kernels for the hot ops."""
