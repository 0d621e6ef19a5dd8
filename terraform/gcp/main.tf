# fedbroker job-node infrastructure on GCP: a custom VPC network and one
# regional subnetwork (Private Google Access), firewall rules for NCCL between
# job nodes and optional SSH, an optional Cloud NAT, a least-privilege service
# account and an instance template (GPU image, no external IP, shielded VM,
# TERMINATE on host maintenance). The broker creates the instances itself
# (instances.insert with the machine type of the chosen offer). See README.md.

locals {
  name        = var.name_prefix
  network_tag = "fedbroker-node"
  labels      = merge(var.labels, { "fedbroker-managed-by" = "fedbroker" })
}

# ------------------------------------------------------------------ network

resource "google_compute_network" "this" {
  name                    = "${local.name}-net"
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"
}

resource "google_compute_subnetwork" "nodes" {
  name          = "${local.name}-nodes-${var.region}"
  region        = var.region
  network       = google_compute_network.this.id
  ip_cidr_range = var.subnet_cidr

  # Nodes have no external IP; Private Google Access lets them reach Google
  # APIs (Artifact Registry, Cloud Storage, Logging, Monitoring) anyway.
  private_ip_google_access = true

  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.1
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# NCCL (bootstrap, socket transport on run-time ports), torchrun rendezvous
# (29400) and gloo all use arbitrary TCP/UDP ports between the nodes of a gang,
# so the rule opens all TCP and UDP — but only from instances that carry the
# tag to instances that carry it.
resource "google_compute_firewall" "nodes_internal" {
  name        = "${local.name}-nodes-internal"
  network     = google_compute_network.this.id
  description = "fedbroker: all TCP/UDP (and ICMP) between job nodes for NCCL"
  direction   = "INGRESS"
  priority    = 1000

  allow {
    protocol = "tcp"
  }

  allow {
    protocol = "udp"
  }

  allow {
    protocol = "icmp"
  }

  source_tags = [local.network_tag]
  target_tags = [local.network_tag]
}

resource "google_compute_firewall" "nodes_ssh" {
  count = var.admin_cidr == null ? 0 : 1

  name        = "${local.name}-nodes-ssh"
  network     = google_compute_network.this.id
  description = "fedbroker: SSH to job nodes from the admin range only"
  direction   = "INGRESS"
  priority    = 1000

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }

  source_ranges = [var.admin_cidr]
  target_tags   = [local.network_tag]
}

resource "google_compute_router" "this" {
  count   = var.enable_nat ? 1 : 0
  name    = "${local.name}-router-${var.region}"
  region  = var.region
  network = google_compute_network.this.id
}

resource "google_compute_router_nat" "this" {
  count  = var.enable_nat ? 1 : 0
  name   = "${local.name}-nat-${var.region}"
  router = google_compute_router.this[0].name
  region = var.region

  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "LIST_OF_SUBNETWORKS"

  subnetwork {
    name                    = google_compute_subnetwork.nodes.self_link
    source_ip_ranges_to_nat = ["ALL_IP_RANGES"]
  }

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

# ------------------------------------------------------------ service account

# A dedicated service account instead of the Compute Engine default one (which
# has project Editor). It gets only:
#   roles/logging.logWriter       - the Ops Agent / Docker gcplogs driver ship
#                                   node and container logs;
#   roles/monitoring.metricWriter - the Ops Agent ships GPU and host metrics.
# Neither can read anything. Optional, scoped to one resource each: pull from
# the listed Artifact Registry repositories, write checkpoints to one bucket.
resource "google_service_account" "node" {
  account_id   = "${local.name}-node"
  display_name = "fedbroker GPU job node"
  description  = "Least privilege: write logs and metrics; optional image pull and checkpoint bucket"
}

resource "google_project_iam_member" "node" {
  for_each = toset(["roles/logging.logWriter", "roles/monitoring.metricWriter"])

  project = var.project
  role    = each.value
  member  = "serviceAccount:${google_service_account.node.email}"
}

resource "google_artifact_registry_repository_iam_member" "node_pull" {
  for_each = toset(var.artifact_registry_repositories)

  project    = split("/", each.value)[1]
  location   = split("/", each.value)[3]
  repository = split("/", each.value)[5]
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.node.email}"
}

resource "google_storage_bucket_iam_member" "node_checkpoints" {
  count = var.checkpoint_bucket == null ? 0 : 1

  bucket = var.checkpoint_bucket
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.node.email}"
}

# ------------------------------------------------------------ instance template

resource "google_compute_instance_template" "node" {
  name_prefix  = "${local.name}-node-"
  description  = "fedbroker GPU job node"
  machine_type = var.machine_type
  region       = var.region
  tags         = [local.network_tag]
  labels       = local.labels

  can_ip_forward = false

  disk {
    source_image = var.gpu_image
    boot         = true
    auto_delete  = true
    disk_type    = var.boot_disk_type
    disk_size_gb = var.boot_disk_size_gb
    labels       = local.labels
  }

  # No access_config block: no external IP. Egress goes through Cloud NAT.
  network_interface {
    subnetwork = google_compute_subnetwork.nodes.id
  }

  # GPU VMs cannot live-migrate: they must TERMINATE on host maintenance.
  scheduling {
    on_host_maintenance = "TERMINATE"
    automatic_restart   = true
  }

  # Shielded VM: the Deep Learning VM images are UEFI images, so vTPM and
  # integrity monitoring work; Secure Boot only with signed drivers (variable).
  shielded_instance_config {
    enable_secure_boot          = var.enable_secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    serial-port-enable     = "FALSE"
    install-nvidia-driver  = "True"
  }

  # cloud-platform scope is Google's recommendation with a custom service
  # account: the IAM roles above are the limit, not the scope.
  service_account {
    email  = google_service_account.node.email
    scopes = ["cloud-platform"]
  }

  lifecycle {
    create_before_destroy = true
  }
}
