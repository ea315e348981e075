//! weir-providers
