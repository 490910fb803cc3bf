//! A simulated node: the GPU facts come from a profile instead of the driver.

use gpumem_profile::Profile;

use super::{GpuError, GpuInfo, GpuSource, NvLinkEnd, TopologyLevel};

impl GpuSource for Profile {
    fn driver_version(&self) -> Result<String, GpuError> {
        Ok(self.driver_version.clone())
    }

    fn cuda_version(&self) -> Result<i32, GpuError> {
        Ok(self.cuda_version)
    }

    fn gpu_count(&self) -> Result<u32, GpuError> {
        Ok(self.gpus.len() as u32)
    }

    fn gpu(&self, index: u32) -> Result<GpuInfo, GpuError> {
        let spec = self.gpus.get(index as usize).ok_or(GpuError::Unexpected {
            what: "GPU index",
            value: index.to_string(),
        })?;
        Ok(GpuInfo {
            index: spec.index,
            uuid: spec.uuid.clone(),
            minor_number: spec.minor_number,
            product: spec.product.clone(),
            memory_mib: spec.memory_mib,
            pci_bus_id: spec.bus_id.clone(),
            numa_node: spec.numa_node,
            compute_capability: spec.compute_capability,
        })
    }

    fn topology(&self, a: u32, b: u32) -> Result<TopologyLevel, GpuError> {
        let n = self.gpus.len() as u32;
        if a >= n || b >= n {
            return Err(GpuError::Unexpected {
                what: "GPU index",
                value: format!("{a}/{b}"),
            });
        }
        Ok(self.topology_level(a as usize, b as usize))
    }

    fn nvlinks(&self, index: u32) -> Result<Vec<NvLinkEnd>, GpuError> {
        Ok(Profile::nvlinks(self, index as usize)
            .into_iter()
            .map(|l| NvLinkEnd {
                remote_bus_id: l.remote_bus_id,
            })
            .collect())
    }
}
