//! weir-core
